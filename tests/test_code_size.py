"""tools.code_size: code lines and guard lines of a synthetic source (fast, no git)."""

from tools.code_size import code_lines, guard_lines, is_guard_name, source_size

SOURCE = '''"""Module docstring."""

import warnings  # a comment on a code line


def check_positive(x, name):  # guard function: all 3 code lines
    """Docstring: not code."""
    if x <= 0:
        raise ValueError(f"{name}={x} is invalid")


def step(x, y):
    total = x + y
    if (x > 10
            and y > 10):  # a two-line test whose body raises: 2 guard lines
        total = 0
        raise ValueError(
            "too large"
        )  # the raise: 3 guard lines
    check_positive(total, "total")  # a call of a guard function: 1 guard line
    if total > 5:  # body warns: 1 guard line
        warnings.warn("large")  # 1 guard line
    elif total > 4:  # body holds no guard: not a guard line
        total -= 1
    return total


class ClipGuard:  # a guarding class: 2 code lines
    pass


def checkpoint(x):  # 'checkpoint' is not the word 'check'
    return x
'''


def test_code_lines_and_guard_lines_of_a_synthetic_source():
    assert code_lines(SOURCE) == 22  # import; 3 in check_positive; 14 in step; 2 in the class; 2 in checkpoint
    assert guard_lines(SOURCE) == 3 + 2 + 3 + 1 + 1 + 1 + 2
    size = source_size(SOURCE, "pkg/step.py")
    assert (size.files, size.lines, size.code_lines, size.guard_lines) == (1, len(SOURCE.splitlines()), 22, 13)


def test_a_guard_module_counts_every_code_line():
    assert guard_lines(SOURCE, "pkg/clip_guard.py") == 22
    assert guard_lines(SOURCE, "pkg/checks.py") == 22
    refusing = '"""Refusing a step that met a non-finite value."""\n\nx = 1\ny = 2\n'
    assert guard_lines(refusing, "pkg/finite.py") == 2


def test_guard_names_split_at_underscores_and_camel_case():
    assert all(map(is_guard_name, ("check_noise", "_refuse", "NonFiniteGuard", "deferred_refusal", "checks")))
    assert not any(map(is_guard_name, ("checkpoint", "_checkpoint_options", "guarded_step", "step")))
