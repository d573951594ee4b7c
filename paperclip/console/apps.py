from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    """The operator console: the floor above every domain app (docs/architecture.md)."""

    name = "paperclip.console"
    label = "console"
    verbose_name = "Operator console"

    def ready(self) -> None:
        from paperclip.console.gauges import StuckWorkCollector
        from paperclip.observability.metrics import scrape_collector_register

        scrape_collector_register(StuckWorkCollector)
