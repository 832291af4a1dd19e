"""Profile handlers: which scheduling profiles a request runs. Today one: every request runs the first (the
only) profile. P/D disaggregation would run a prefill and a decode profile and join their results."""
from __future__ import annotations

from ..framework import Context, Profile, ProfileHandler
from ..registry import register_profile_handler
from ..request import Decision


@register_profile_handler("single-profile-handler")
class SingleProfileHandler(ProfileHandler):
    def pick_profiles(self, ctx: Context, profiles: dict[str, Profile]) -> list[str]:
        return [next(iter(profiles))]

    def process_results(self, ctx: Context, results: dict[str, Decision]) -> Decision:
        return next(iter(results.values()))
