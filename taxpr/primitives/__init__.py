"""taxpr's primitives."""

from ._tag import (
    TagEffect as TagEffect,
    keep_tags as keep_tags,
    tag as tag,
    tag_cotangent_p as tag_cotangent_p,
    tag_p as tag_p,
    tag_tangent_p as tag_tangent_p,
    user_params as user_params,
)
