"""Hook specifications and the plugin manager (pluggy project name ``jitney``).

Plugins are found through the ``jitney`` entry-point group, the built-in schedulers and attention backends
included, so the built-ins are the examples a third-party package follows::

    [project.entry-points.jitney]
    my_scheduler = "my_package.plugin"      # a module with @hookimpl functions
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("jitney")
hookimpl = pluggy.HookimplMarker("jitney")


class Hookspecs:
    """Every hook a jitney plugin may implement."""

    @hookspec
    def jitney_register_schedulers(self, register: Callable[[str, Callable[..., Any]], None]) -> None:
        """Register scheduler factories, called once when an engine starts.

        Call ``register(name, factory)`` once per scheduler; ``factory(config)`` returns an object following
        `jitney.schedulers.base.Scheduler`. The config's ``scheduler`` field selects one by name.
        """

    @hookspec
    def jitney_register_attention_backends(self, register: Callable[[str, Callable[..., Any]], None]) -> None:
        """Register attention backend factories, called once when an engine starts.

        Call ``register(name, factory)``; ``factory(device)`` returns an object following
        `jitney.kernels.base.AttentionBackend`. The config's ``attention_backend`` field selects one by name.
        """

    @hookspec
    def jitney_register_eviction_policies(self, register: Callable[[str, Callable[..., Any]], None]) -> None:
        """Register eviction policy factories, called once when an engine starts.

        Call ``register(name, factory)``; ``factory(config)`` returns an object following
        `jitney.cache.eviction.EvictionPolicy`. The config's ``eviction`` field selects one by name.
        """

    @hookspec
    def jitney_register_offload_backends(self, register: Callable[[str, Callable[..., Any]], None]) -> None:
        """Register offload backend factories, called once when an engine starts.

        Call ``register(name, factory)``; ``factory(config, cache)`` returns an object following
        `jitney.cache.offload.OffloadBackend`, or None when the config turns it off. The config's
        ``offload_backend`` field selects one by name.
        """

    @hookspec
    def jitney_register_routers(self, register: Callable[[str, Callable[..., Any]], None]) -> None:
        """Register router factories, called once when a fleet of replicas starts (`jitney serve --replicas`).

        Call ``register(name, factory)``; ``factory(config)`` (a `jitney.routers.base.RouterConfig`) returns an object
        following `jitney.routers.base.Router`. ``--router`` selects one by name.
        """

    @hookspec
    def jitney_register_logits_processors(self, register: Callable[[str, Callable[..., Any]], None]) -> None:
        """Register logits processor factories, called once when an engine starts.

        Call ``register(name, factory)``; ``factory(engine)`` returns a callable ``(logits, row) -> logits``
        (`jitney.core.processors`). A request names the ones its rows run in ``SamplingParams(processors=...)``.
        """

    @hookspec
    def jitney_engine_started(self, engine: Any) -> None:
        """The engine's step loop has started."""

    @hookspec
    def jitney_engine_stopped(self, engine: Any) -> None:
        """The engine's step loop has stopped; every request has ended."""

    @hookspec
    def jitney_on_events(self, events: list[Any], engine: Any) -> None:
        """Observe one step's lifecycle events (a list of `jitney.core.events` structs).

        Called once per step, never once per token, on the event loop's thread: keep it short, or hand the
        events to a thread of your own. An exception here is logged and does not stop the engine.
        """


def make_plugin_manager(plugins: Iterable[object] = ()) -> pluggy.PluginManager:
    """Load every plugin of the ``jitney`` entry-point group, plus `plugins` given in code."""
    pm = pluggy.PluginManager("jitney")
    pm.add_hookspecs(Hookspecs)
    pm.load_setuptools_entrypoints("jitney")
    for plugin in plugins:
        pm.register(plugin)
    pm.check_pending()  # a misspelled hook name fails here, loudly
    return pm


ROLES = {
    "scheduler": "jitney_register_schedulers",
    "eviction policy": "jitney_register_eviction_policies",
    "offload backend": "jitney_register_offload_backends",
    "attention backend": "jitney_register_attention_backends",
    "router": "jitney_register_routers",
    "logits processor": "jitney_register_logits_processors",
}
"""Each plugin role and the registration hook that fills it."""


def registry(pm: pluggy.PluginManager, role: str) -> "Registry":
    return Registry(role, getattr(pm.hook, ROLES[role]))


def describe_plugins(pm: pluggy.PluginManager) -> list[tuple[str, str, str]]:
    """(role, name, providing distribution) for every registered plugin, observers of the events included."""
    dists = {pm.get_name(plugin): f"{dist.project_name} {dist.version}" for plugin, dist in pm.list_plugin_distinfo()}
    rows = []
    for role in ROLES:
        reg = registry(pm, role)
        rows += [(role, name, dists.get(reg.providers[name], "registered in code")) for name in sorted(reg.factories)]
    for impl in pm.hook.jitney_on_events.get_hookimpls():
        rows.append(("observer", impl.plugin_name, dists.get(impl.plugin_name, "registered in code")))
    return rows


class Registry:
    """Plugins of one role, by name, filled by one registration hook; remembers which plugin gave each."""

    def __init__(self, role: str, hook: Any):
        self.role = role
        self.factories: dict[str, Callable[..., Any]] = {}
        self.providers: dict[str, str] = {}
        for impl in hook.get_hookimpls():
            impl.function(register=lambda name, factory, _by=impl.plugin_name: self.register(name, factory, _by))

    def register(self, name: str, factory: Callable[..., Any], provider: str = "") -> None:
        if name in self.factories:
            raise ValueError(f"{self.role} {name!r} is registered twice ({self.providers[name]}, {provider})")
        self.factories[name] = factory
        self.providers[name] = provider

    def create(self, name: str, *args: Any) -> Any:
        try:
            factory = self.factories[name]
        except KeyError:
            known = ", ".join(sorted(self.factories)) or "none (is jitney installed, e.g. `pip install -e .`?)"
            raise ValueError(f"unknown {self.role} {name!r}; registered: {known}") from None
        return factory(*args)
