from django.apps import AppConfig


class RecoveryConfig(AppConfig):
    name = "recovery"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from paperclip.api.serializers import run_block_register
        from recovery.api.serializers import run_finalization_block

        run_block_register("finalization", run_finalization_block)
