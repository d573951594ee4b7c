from django.apps import AppConfig


class LeasesConfig(AppConfig):
    name = "leases"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from leases.api.run_block import run_liveness_block, run_orphaned_since_block
        from leases.orphans import run_liveness
        from paperclip.api.serializers import run_block_register
        from paperclip.services.runs import run_liveness_judge_register

        run_block_register("orphaned_since", run_orphaned_since_block)
        run_block_register("liveness", run_liveness_block)
        run_liveness_judge_register(run_liveness)

        from leases.api.batch import RUNTIME_KIND
        from paperclip.renewals import renew_kind_register

        renew_kind_register(RUNTIME_KIND)
