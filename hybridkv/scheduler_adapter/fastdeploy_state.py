"""Moved to :mod:`hybridkv.integrations.fastdeploy.state` (issue 42): this path re-exports it for code
written against it. New code imports from :mod:`hybridkv.integrations.fastdeploy`."""

from hybridkv.integrations.fastdeploy.state import *  # noqa: F403

