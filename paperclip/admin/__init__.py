"""The core's admin, by concern: `toolkit` (what every app's admin builds on), `lists` (list
pages whose cost stays flat), `core` (the core models' pages) and `worker` (the worker's
pages). Importing the package registers the core's pages (Django's admin autodiscovery)."""

from paperclip.admin import core, worker

__all__ = ["core", "worker"]
