"""Moved to :mod:`hybridkv.integrations.fastdeploy.worker` (issue 42): this path re-exports it for code
written against it. New code imports from :mod:`hybridkv.integrations.fastdeploy`."""

from hybridkv.integrations.fastdeploy.host_tier import *  # noqa: F403  (W6 was in this module)
from hybridkv.integrations.fastdeploy.worker import *  # noqa: F403
