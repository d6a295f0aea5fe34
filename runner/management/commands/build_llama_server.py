"""`manage.py build_llama_server`: build llama.cpp's server once into the user's cache and print its path."""

from django.core.management.base import BaseCommand, CommandError

from runner.llama_server import LLAMA_CPP_PYTHON_VERSION, BuildError, build_llama_server, build_place


class Command(BaseCommand):
    help = (
        "Build llama.cpp's llama-server (CPU) from the llama-cpp-python source distribution into "
        "$XDG_CACHE_HOME/llmgw (default ~/.cache/llmgw) unless it is there already; the last line printed is "
        "the binary's path, for LLMGW_LLAMA_SERVER."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--release",
            dest="llama_version",
            default=LLAMA_CPP_PYTHON_VERSION,
            help=f"llama-cpp-python release whose vendored llama.cpp is built (default {LLAMA_CPP_PYTHON_VERSION})",
        )
        parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: CPU count)")
        parser.add_argument("--force", action="store_true", help="build again even if the cache has a binary")

    def handle(self, *args, llama_version, jobs, force, **options):
        if jobs is not None and jobs < 1:
            raise CommandError(f"--jobs must be at least 1, got {jobs}.")
        if not llama_version or not all(part.isdigit() for part in llama_version.split(".")):
            raise CommandError(f"--release must look like {LLAMA_CPP_PYTHON_VERSION}, got {llama_version!r}.")
        place = build_place(llama_version)
        try:
            binary = build_llama_server(
                llama_version,
                place=place,
                jobs=jobs,
                force=force,
                progress=lambda line: self.stderr.write(line),
            )
        except BuildError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(str(binary))
