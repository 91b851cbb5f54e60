"""Engine core: config, requests, events, plugin hooks, the engine and its step executor."""
