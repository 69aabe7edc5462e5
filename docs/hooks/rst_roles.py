"""A griffe extension for the API reference (mkdocs.yml): jaxft's docstrings name objects with
Sphinx roles (``:class:`~jaxft.Timeouts```, ``:func:`initialize```, ``:mod:`jaxft.core```).
Markdown has no roles, so each becomes inline code, linked where the object is on a page of
the reference (an optional autorefs link: no link, and no warning, where it is not)."""

from __future__ import annotations

import html
import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`(?P<target>[^`]+)`")


def _resolve(target: str, obj: griffe.Object) -> tuple[str, str]:
    """(identifier, shown text) of a role's target, as Sphinx reads it."""
    title = None
    if "<" in target and target.endswith(">"):  # :class:`text <path>`
        title, target = target[:-1].split("<", 1)
        title = title.strip()
    short = target.startswith("~")
    target = target.lstrip("~.")
    shown = title or (target.rsplit(".", 1)[-1] if short else target)
    if not target.startswith("jaxft"):  # relative to the docstring's module, or its class
        scope = obj if obj.is_module or obj.is_class else obj.parent
        while scope is not None and target.split(".", 1)[0] not in scope.members and scope.parent is not None:
            scope = scope.parent
        target = f"{scope.path}.{target}" if scope is not None else target
    return target, shown


class RstRoles(griffe.Extension):
    """Rewrite Sphinx roles in every docstring into optional cross-references."""

    def _fix(self, obj: griffe.Object) -> None:
        if obj.docstring is None:
            return

        def replace(match: re.Match) -> str:
            identifier, shown = _resolve(match["target"], obj)
            return (f'<autoref identifier="{html.escape(identifier)}" optional>'
                    f"<code>{html.escape(shown)}</code></autoref>")

        obj.docstring.value = ROLE.sub(replace, obj.docstring.value)

    def _walk(self, obj: griffe.Object) -> None:
        self._fix(obj)
        for member in obj.members.values():
            if not member.is_alias:
                self._walk(member)

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        self._walk(pkg)  # the whole tree is there: relative targets resolve against it
