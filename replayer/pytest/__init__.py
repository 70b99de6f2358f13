"""Goldens as tests: the pytest plugin (:mod:`.plugin`, collecting scenario YAML
and trace directories) and the testing API (:mod:`.testing`) a project's own
tests call. It imports :mod:`replayer.replay` and :mod:`replayer.check`, never
the CLI.
"""
