"""Hand-written cases for final-answer extraction and answer equivalence."""

from fractions import Fraction

import pytest

from lightrft.rewards.math_answer import (
    answers_match,
    extract_answer,
    extract_answer_is,
    extract_boxed,
    extract_hashes,
    extract_last_number,
    normalize_answer,
    parse_number,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so the answer is \boxed{18}.", "18"),
        (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),  # nested braces
        (r"first \boxed{1}, then \boxed{2}", "2"),  # the last box
        (r"\boxed{\left\{ 1, 2 \right\}}", r"\left\{ 1, 2 \right\}"),
        (r"ok \boxed{1} but then \boxed{2", "1"),  # an unclosed last box is skipped
        (r"\fbox{7}", "7"),
        (r"$\boxed 5$", "5"),
        (r"\boxed{ -3 }", "-3"),
        ("no box here 42", None),
        (r"\boxed{", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("He makes 9 * 2 = $18 every day.\n#### 18", "18"),
        ("#### 1,000\nmore text", "1,000"),
        ("#### 3\n#### 4", "4"),
        ("####-7", "-7"),
        ("#### \n", None),
        ("# 5", None),
    ],
)
def test_extract_hashes(text, expected):
    assert extract_hashes(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 18.", "18"),
        ("So the final answer is: $3.50. Thanks!", "$3.50"),
        ("Answer: 7", "7"),
        ("the answer is 2.5 km", "2.5 km"),
        ("The answer is 1.\nWait, the answer is 2", "2"),  # the last statement wins
        ("ANSWER IS -4", "-4"),
        ("no statement here", None),
    ],
)
def test_extract_answer_is(text, expected):
    assert extract_answer_is(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3 apples and 4 pears make 7", "7"),
        ("It costs $1,234.50 in total", "1,234.50"),
        ("we get 10-3 = 7 apples", "7"),
        ("the temperature is -5 degrees", "-5"),
        ("computing 10-3", "3"),  # a minus after a digit is subtraction, not a sign
        ("the ratio is 3/4.", "3/4"),
        (r"half, \frac{1}{2} of it", r"\frac{1}{2}"),
        ("values 1,2,3", "3"),  # not thousands separators
        ("about .5 left", ".5"),
        ("no digits", None),
    ],
)
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected


def test_extract_answer_order():
    text = "The answer is 3.\n#### 4\nso \\boxed{5} and 6"
    assert extract_answer(text) == "5"
    assert extract_answer(text, ("hashes", "boxed")) == "4"
    assert extract_answer(text, ("answer_is",)) == "3"
    assert extract_answer(text, ("last_number",)) == "6"
    assert extract_answer("nothing", ("boxed", "hashes")) is None
    with pytest.raises(ValueError, match="unknown answer extractor 'boxes'"):
        extract_answer(text, ("boxes",))


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("$18$", "18"),
        (r"\$1,450,000", "1450000"),
        (r"\text{18 dollars}", "18 dollars"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\tfrac12", r"\frac{1}{2}"),
        (r"90^\circ", "90"),
        (r"90^{\circ}", "90"),
        ("x = 5", "5"),
        ("(B)", "B"),
        (r"50\%", "50%"),
        ("7.", "7"),
        (r"\left( 1, 2 \right)", "( 1, 2 )"),
        ("\u22123", "-3"),
        (r"\boxed{4}", "4"),
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


@pytest.mark.parametrize(
    "text, value, percent",
    [
        ("18", Fraction(18), False),
        ("18.00", Fraction(18), False),
        ("-0.75", Fraction(-3, 4), False),
        ("3/4", Fraction(3, 4), False),
        (r"\frac{-1}{2}", Fraction(-1, 2), False),
        (r"-\frac{3}{4}", Fraction(-3, 4), False),
        (r"2\frac{1}{2}", Fraction(5, 2), False),
        ("1e3", Fraction(1000), False),
        ("50%", Fraction(50), True),
        ("50 percent", Fraction(50), True),
        ("18 dollars", Fraction(18), False),
        ("5 km/h", Fraction(5), False),
        ("12 m^2", Fraction(12), False),
    ],
)
def test_parse_number(text, value, percent):
    assert parse_number(text) == (value, percent)


@pytest.mark.parametrize(
    "text", ["x+1", "5x", "3 apples and 2 pears", r"\sqrt{2}", "1/0", "abc", "", "(1,2)"]
)
def test_parse_number_rejects(text):
    assert parse_number(text) is None


EQUAL = [
    ("18", "18"),
    ("18", "18.0"),
    ("18.00", "18"),
    ("$18", "18"),
    (r"\$18.00", "18"),
    ("18 dollars", "18"),
    ("18 eggs per day", "18"),
    ("1,000", "1000"),
    ("1,450,000", "1450000"),
    ("3/4", "0.75"),
    (r"\frac{3}{4}", "0.75"),
    (r"\dfrac{3}{4}", "3/4"),
    (r"\tfrac{1}{2}", "0.5"),
    (r"\frac12", "1/2"),
    ("-7", "-7.0"),
    (r"-\frac{1}{2}", "-0.5"),
    (r"\frac{-1}{2}", "-1/2"),
    ("50%", "50"),
    ("50%", "0.5"),
    (r"50\%", "0.5"),
    ("12.5%", "0.125"),
    ("x = 5", "5"),
    (r"2\frac{1}{2}", "2.5"),
    ("0.3333333", "1/3"),
    (r"\boxed{42}", "42"),
    ("(1, 2)", "(1,2)"),
    (r"\left(1, \frac{1}{2}\right)", "(1, 0.5)"),
    (r"\frac{\pi}{2}", r"\dfrac{\pi}{2}"),
    (r"\sqrt2", r"\sqrt{2}"),
    (r"\text{(B)}", "B"),
    (r"90^\circ", "90"),
    ("\u22123", "-3"),
    ("+4", "4"),
]

NOT_EQUAL = [
    ("18", "19"),
    ("1000001", "1000000"),  # integers compare exactly, no relative tolerance
    ("0.33", "1/3"),
    ("-7", "7"),
    ("5x", "5"),
    ("3 apples and 2 pears", "3"),
    ("(1, 2)", "(2, 1)"),
    ("(1, 2)", "(1, 2, 3)"),
    (r"\sqrt{8}", r"2\sqrt{2}"),  # no algebra
    ("A", "B"),
    ("", "0"),
    (None, "0"),
]


@pytest.mark.parametrize("a, b", EQUAL)
def test_answers_match(a, b):
    assert answers_match(a, b)
    assert answers_match(b, a)  # symmetric


@pytest.mark.parametrize("a, b", NOT_EQUAL)
def test_answers_differ(a, b):
    assert not answers_match(a, b)
    assert not answers_match(b, a)


def test_percent_forms():
    # A percentage matches its number and its fraction of one, nothing else.
    assert answers_match("0.5%", "0.5") and answers_match("0.5%", "0.005")
    assert not answers_match("0.5%", "0.05")


def test_oversized_numbers_are_not_numbers():
    from lightrft.rewards.math_answer import (
        MAX_NUMBER_DIGITS,
        MAX_NUMBER_EXPONENT,
        answer_key,
        oversized_number,
        parse_number,
    )

    # "1." before the exponent is a decimal too (Fraction reads it): answer_key hung on it.
    dotted = ("1.e31000000", "1.E12345678901234567890")
    for ans in ("1e999999999", "1E-10001", "10^{10001}", "1" * (MAX_NUMBER_DIGITS + 1), *dotted):
        assert oversized_number(ans) and parse_number(ans) is None, ans
    for ans in (*dotted, "11.e31,000,000"):  # separators go before the number is read
        assert answer_key(ans) == normalize_answer(ans) and not answers_match(ans, "1"), ans
    assert "999999999 (the bound is" in oversized_number("1e999999999")
    assert "(20 digits)" not in oversized_number("1e" + "9" * 5000)  # shown shortened
    for ans in (f"1e{MAX_NUMBER_EXPONENT}", "2^{2023}", "9" * MAX_NUMBER_DIGITS, "6.02e23"):
        assert oversized_number(ans) is None, ans
    assert parse_number("6.02e23") is not None


def test_is_equation():
    from lightrft.rewards.math_answer import is_equation

    for ans in ("100 = 7", "2x = 14", "a + b = c", "x = 3, 2y = 4"):
        assert is_equation(ans), ans
    for ans in (
        "7",
        "x = 7",
        r"\alpha' = 7",
        "y_{n} = 2n",
        "(x, y) = (1, 2)",
        "x \\le 3",
        "x >= 3",
    ):
        assert not is_equation(ans), ans


def test_is_equation_with_labels_reads_named_values():
    from lightrft.rewards.math_answer import is_equation

    for ans in ("100 = 7", "2x = 14", "3 + 4 = 7", "x^2 + y^2 = 1", r"\frac{1}{2} = \frac{10}{9}"):
        assert is_equation(ans, labels=True), ans  # a number on the left: an equation
    for ans in ("AB = 4", "|AB| = 1", "f(x) = 1", "V_{1}:V_{2} = 11:21", "a + b = c", "x = 7"):
        assert not is_equation(ans, labels=True), ans
        assert is_equation(ans) is (ans != "x = 7")  # the rules' reading is unchanged


def test_equation_mismatch():
    from lightrft.rewards.math_answer import equation_mismatch

    assert equation_mismatch("100 = 7", "7") and equation_mismatch("7", "3 + 4 = 7")
    assert not equation_mismatch("AB = 4", "4") and not equation_mismatch("x = 8", "7")
    # Both hold an `=`: math-verify compares them (a line in two forms).
    assert not equation_mismatch(r"y = -\frac{1}{2}x + \frac{3}{4}", "2x + 4y - 3 = 0")


@pytest.mark.parametrize(
    "text, answer",
    [
        (r"so \boxed{42}.", "42"),
        ("  -0.5 ", "-0.5"),
        (r"\boxed{1,000}", "1,000"),
        (r"\boxed{\frac{3}{4}}", r"\frac{3}{4}"),
        ("3/4", "3/4"),
        (r"\boxed{1}\boxed{2}", None),  # several boxes: a set, math-verify's to read
        (r"\boxed{\frac13}", None),
        ("0,111", None),  # a decimal comma to math-verify
        ("1 000", None),
        (r"\boxed{x = 7}", None),
        ("The answer is 5", None),
        (r"\boxed{1e5}", None),
    ],
)
def test_plain_number_answer(text, answer):
    from lightrft.rewards.math_answer import plain_number_answer

    assert plain_number_answer(text) == answer


def test_math_verify_reference():
    from lightrft.rewards.math_answer import math_verify_reference

    assert math_verify_reference("Half of 8 is 4.\n#### 1,200") == r"\boxed{1,200}"
    assert math_verify_reference(r" \frac{1}{2} ") == r"\boxed{\frac{1}{2}}"
    assert math_verify_reference(r"\$18") == r"\boxed{\$18}"  # an escaped dollar is no math
    for marked in (r"so \boxed{3}", "$9$", r"\( x \)", r"$1$ and $2$"):
        assert math_verify_reference(marked) == marked
