"""One module per ``mmformer`` command, holding the workflow it runs (``train``, ``validate``,
``generate``, ``sample``, ``export``, ``info``, ``data``); ``mmformer.cli`` parses and dispatches."""
