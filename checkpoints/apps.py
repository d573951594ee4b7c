from django.apps import AppConfig


class CheckpointsConfig(AppConfig):
    name = "checkpoints"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from checkpoints import checks  # noqa: F401  (registers the key check)
        from checkpoints.api.batch import CONTROLLER_KIND
        from paperclip.renewals import renew_kind_register

        renew_kind_register(CONTROLLER_KIND)
