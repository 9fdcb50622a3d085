"""The dataflow explorer: a local web page over :mod:`flashflow.dataflow` (``flashflow viz``)."""
