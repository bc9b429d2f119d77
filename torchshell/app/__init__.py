"""The coreshell application: the ``coreshell`` commands and what only they need.

``cli`` (the commands), ``config`` (schemas, composition, the typed config), ``prepare``
(``prepare_run`` and ``build``, shared by ``train`` and ``doctor``), ``train``, ``doctor``,
``launch``, ``publish`` (the end of a run), ``export_cli``, ``console`` and ``quiet`` (what
the console shows). The library (``torchshell.module``, ``checkpoint``, ``data``,
``tracking``, ...) never imports this package.
"""
