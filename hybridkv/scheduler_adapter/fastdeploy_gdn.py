"""Moved to :mod:`hybridkv.integrations.fastdeploy.gdn` (issue 42): this path re-exports it for code
written against it. New code imports from :mod:`hybridkv.integrations.fastdeploy`."""

from hybridkv.integrations.fastdeploy.gdn import *  # noqa: F403

