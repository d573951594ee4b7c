"""The worker (docs/worker.md): Procrastinate jobs and periodic tasks on the project database.

- jobs: defer a job inside the transaction that causes it, find a run's pending job;
- schedule: the interval settings as cron schedules for periodic tasks;
- health: worker heartbeats and the readiness report of `/readyz`;
- process: start a worker process that registers where it runs and records job errors.

Tasks themselves live in each app's `tasks.py` (Procrastinate's autodiscovery), beside the
services they call; domain services defer them by name, so no service imports a task module.
"""
