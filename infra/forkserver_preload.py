"""Imported by datatrove's forkserver when it starts (multiprocess.set_forkserver_preload): the forkserver dies
with the run that started it, and so does every pool worker it forks (see compass.infra.die_with_parent)."""

from __future__ import annotations

import os

from compass.infra.die_with_parent import die_with_parent

die_with_parent()
os.register_at_fork(after_in_child=die_with_parent)
