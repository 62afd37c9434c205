"""What every shipped contract suite shares: inapplicable cases are skipped, with the reason.

A suite's cases live in mixins: one with the cases every plugin must pass, and one per
optional capability (a hook the plugin may provide, a behaviour it may declare). The full
contract class includes them all; a plugin's test subclasses it, and every case that does
not apply to that plugin is reported as skipped, saying why, so a run shows what was not
checked. A case also applies or not by the class attribute :attr:`Contract.unsupported`,
for a plugin that cannot meet one (``{"test_x": "why"}``)::

    class TestMyStore(CacheStoreContract):
        unsupported = {"test_entry_expires_after_its_ttl": "entries never expire"}

A test class that wants no skips includes only the mixins that apply; the case
:meth:`Contract.test_includes_every_case_that_applies` then checks that no applicable
mixin was left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import pytest


def case_names(cls: type) -> set[str]:
    """The test cases (``test_*`` methods) a class has, inherited ones included."""
    return {name for name in dir(cls) if name.startswith("test_")
            and callable(getattr(cls, name, None))}


class Contract:
    """Base of the contract suites; see the module docstring."""

    #: Cases this plugin cannot meet: case name -> the reason it is skipped.
    unsupported: ClassVar[Mapping[str, str]] = {}
    #: The suite's full contract class (every case); set by each suite.
    full_contract: ClassVar[type[Contract]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        unknown = sorted(set(cls.unsupported) - case_names(cls))
        if unknown:
            raise TypeError(f"{cls.__name__}.unsupported names no case of it: "
                            f"{', '.join(unknown)}")

    @classmethod
    def skipped_cases(cls) -> dict[str, str]:
        """Every case of the full contract that does not apply to this class's plugin,
        with the reason: :attr:`unsupported`, and what a suite derives from the plugin's
        hooks and flags (a suite extends this)."""
        return dict(cls.unsupported)

    @pytest.fixture(autouse=True)
    def _skip_cases_that_do_not_apply(self, request: pytest.FixtureRequest) -> None:
        reason = self.skipped_cases().get(request.function.__name__)
        if reason is not None:
            pytest.skip(reason)

    def test_includes_every_case_that_applies(self) -> None:
        """A class built from the mixins leaves none out that its plugin supports."""
        applicable = case_names(self.full_contract) - set(self.skipped_cases())
        missing = sorted(applicable - case_names(type(self)))
        assert not missing, (
            f"{type(self).__name__} leaves out cases that apply to its plugin: "
            f"{', '.join(missing)}; include their mixins (or the full contract)")
