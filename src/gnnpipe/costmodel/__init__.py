"""The analytical cost model, in three parts that serve three users (import the part you need):

* :mod:`.bytes`: bytes per epoch, exact closed forms: the only part the engines import;
* :mod:`.work` and :mod:`.estimate`: what a conv declares about its work
  (``gnnpipe.models.<kind>.work``), and the epoch time and peak memory of a layout priced from
  it on a hardware profile and the engine's own schedule (``gnnpipe.schedule``): planning and
  the report;
* :mod:`.hardware`: hardware profiles (``config/hardware/*.yaml``), the only file I/O.

No torch anywhere in it: the layers hand their work functions in (``LayerSpec.work``).
"""
