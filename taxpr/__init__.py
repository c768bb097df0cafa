"""taxpr: a tag-and-inject effect system for JAX."""

from ._find import (
    TagSite as TagSite,
    dissolve_tags as dissolve_tags,
    find_tags as find_tags,
    iter_tags as iter_tags,
)
from .primitives import tag as tag, tag_p as tag_p
