from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    """The operator console: the floor above every domain app (docs/architecture.md)."""

    name = "recovery.console"
    label = "console"
    verbose_name = "Operator console"

    def ready(self) -> None:
        from paperclip.observability.metrics import scrape_collector_register
        from recovery.console.gauges import StuckWorkCollector

        scrape_collector_register(StuckWorkCollector)
