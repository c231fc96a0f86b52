"""Models: loading (the embedded GGUF, hub ids, local directories, random shapes, tiny in-process ones), what a
deployment may load, and the cache folder."""
