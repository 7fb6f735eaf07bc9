"""An APP module that imports a sibling module that does not exist (a typo in an import)."""

import apps.bad  # noqa: F401 - the missing module; its name is a prefix of this one's
from asyncjobq import Queue

queue = Queue()
