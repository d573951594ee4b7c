from django.apps import AppConfig


class EnvironmentLeasesConfig(AppConfig):
    name = "leases.environment"
    label = "leases_environment"
    verbose_name = "Environment leases"
