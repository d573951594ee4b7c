"""Helpers for the tests, the benches and the chaos test only; not shipped with the apps."""
