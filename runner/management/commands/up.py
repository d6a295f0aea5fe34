"""`manage.py up [--demo]`: run the whole of llmgw in one process (embedded mode)."""

import asyncio
from pathlib import Path

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.http.request import validate_host

from catalog.catalog_file import CatalogFileError
from nodewire.protocol import parse_port
from runner import embedded
from runner.demo import CREDENTIALS_FILE, DemoCredentialsError, create_demo_fleet

WILDCARD_HOSTS = ("0.0.0.0", "::")


def _port(value: str) -> int:
    try:
        return parse_port(value)
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CommandError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None


class Command(BaseCommand):
    help = (
        "Run the control plane, the router and the reconcile ticker in one process (SQLite by default). "
        "Applies pending migrations first."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--demo", action="store_true", help="Also create a demo catalog, key and three simulated nodes."
        )
        parser.add_argument(
            "--catalog",
            metavar="FILE",
            help="With --demo: apply this catalog file (the `manage.py catalog export` format) "
            "instead of the bundled demo catalog.",
        )
        parser.add_argument("--host", default=settings.LLMGW_HOST, help="Address to listen on (LLMGW_HOST).")
        parser.add_argument("--port", default=str(settings.LLMGW_PORT), help="Control plane port (LLMGW_PORT).")
        parser.add_argument(
            "--router-port", default=str(settings.LLMGW_ROUTER_PORT), help="Router port (LLMGW_ROUTER_PORT)."
        )

    def handle(self, *args, demo, catalog, host, port, router_port, **options):
        port, router_port = _port(port), _port(router_port)
        if catalog is not None and not demo:
            raise CommandError(
                "--catalog goes with --demo; to change a running fleet's catalog: manage.py catalog apply FILE"
            )
        catalog_text = _read(catalog) if catalog is not None else None
        if port == router_port:
            raise CommandError("--port and --router-port must differ")
        as_header = f"[{host}]" if ":" in host and not host.startswith("[") else host
        if host not in WILDCARD_HOSTS and not validate_host(as_header, settings.ALLOWED_HOSTS):
            # Settings are read once from the environment, never patched at run time.
            raise CommandError(
                f"host {host} is not in ALLOWED_HOSTS ({', '.join(settings.ALLOWED_HOSTS)}): "
                f"start with LLMGW_HOST={host} (or add it to ALLOWED_HOSTS)"
            )
        call_command("migrate", interactive=False, verbosity=0)
        try:
            fleet = create_demo_fleet(catalog_text=catalog_text) if demo else None
        except CatalogFileError as exc:
            listing = "\n".join(f"  {m}" for m in exc.messages)
            raise CommandError(f"{catalog or 'the demo catalog'}: nothing started:\n{listing}") from None
        except DemoCredentialsError as exc:
            raise CommandError(f"nothing started: {exc}") from None

        def announce():
            self.stdout.write(self._banner(host, port, router_port, fleet))
            self.stdout.flush()

        try:
            asyncio.run(embedded.serve(host, port, router_port, fleet, on_ready=announce))
        except OSError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write("llmgw stopped.")

    @staticmethod
    def _node_text(node) -> str:
        return (
            f"{node.name} ({node.fake_gpus}, fabric {node.fabric})"
            if node.fabric
            else f"{node.name} ({node.fake_gpus})"
        )

    @staticmethod
    def _example_model(fleet) -> str:
        """The name to try: the catalog file's first model, by its first alias (the demo's: llama3)."""
        wanted = next((m.wanted for m in fleet.catalog.models if m.wanted is not None), None)
        if wanted is None:
            return "llama3"
        return wanted.aliases[0] if wanted.aliases else wanted.name

    def _credentials_text(self, fleet) -> str:
        """Whether the demo's password and key are new, so a user knows if an old curl line still works."""
        kept = Path(settings.VAR_DIR) / CREDENTIALS_FILE
        if fleet.credentials == "new":
            return f"new (kept in {kept}; the next run reuses them)"
        if fleet.credentials == "reused":
            return f"reused from {kept} (delete it for new ones)"
        return "from LLMGW_DEMO_ADMIN_PASSWORD / LLMGW_DEMO_API_KEY"

    def _banner(self, host, port, router_port, fleet) -> str:
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        web = "https" if settings.LLMGW_TLS_CERT_FILE else "http"
        database = settings.DATABASES["default"]
        where = f"SQLite at {database['NAME']}" if database["ENGINE"].endswith("sqlite3") else database["ENGINE"]
        lines = [
            self.style.SUCCESS(f"llmgw is up ({'embedded' if settings.EMBEDDED else 'Redis'} mode, {where})"),
            f"  router (OpenAI API)   http://{shown}:{router_port}/v1",
            f"  admin and dashboard   {web}://{shown}:{port}/admin/",
            f"  REST API              {web}://{shown}:{port}/api/v1/status",
        ]
        if fleet is not None:
            lines += [
                f"  admin login           {fleet.admin_user} / {fleet.admin_password}",
                f"  API key               {fleet.api_key}",
                f"  credentials           {self._credentials_text(fleet)}",
                f"  nodes                 {', '.join(self._node_text(n) for n in fleet.nodes)}",
                f"  catalog               {fleet.catalog.lines()[-1]}",
                "",
                "Try it (the first request starts the model, then answers):",
                f"  curl http://{shown}:{router_port}/v1/chat/completions \\",
                f'    -H "Authorization: Bearer {fleet.api_key}" -H "Content-Type: application/json" \\',
                f"""    -d '{{"model": "{self._example_model(fleet)}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'""",
            ]
        lines += ["", "Ctrl-C stops everything, engines included.", ""]
        return "\n".join(lines)
