"""App configuration for inventory."""

from django.apps import AppConfig
from django.db.models import Max

from catalog.sizing import ReportedWeights, reported_from_row, set_fleet_memory, set_reported_weights


class InventoryConfig(AppConfig):
    """The inventory app."""

    default_auto_field = "django.db.models.BigAutoField"
    name = "inventory"

    def ready(self) -> None:
        # The catalog judges profiles on the GPU memory agents report (catalog.sizing); it sits below the
        # inventory, so the inventory hands it the reader. The model is imported here, as Django asks:
        # models are ready only now.
        from inventory.models import GPU, Weights

        def reported() -> dict[str, int]:
            rows = GPU.objects.filter(memory_mb__gt=0).values("gpu_class").annotate(mib=Max("memory_mb"))
            return {row["gpu_class"]: row["mib"] for row in rows}

        def headers(sources) -> dict[str, ReportedWeights]:
            found = {}
            for source, (header, node) in Weights.objects.reported_headers(sources).items():
                if (reported_weights := reported_from_row(header, node)) is not None:
                    found[source] = reported_weights
            return found

        set_fleet_memory(reported)
        # Likewise the weights' headers agents report: the catalog sizes hub models by them.
        set_reported_weights(headers)
