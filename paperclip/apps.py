from django.apps import AppConfig


class PaperclipConfig(AppConfig):
    name = "paperclip"
    verbose_name = "Paperclip core"
    default_auto_field = "django.db.models.BigAutoField"
