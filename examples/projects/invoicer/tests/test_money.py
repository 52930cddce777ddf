import unittest

from invoicer import format_cents, split_evenly, total_with_tax


class FormatTest(unittest.TestCase):
    def test_format(self):
        self.assertEqual(format_cents(1999), "19.99")
        self.assertEqual(format_cents(5), "0.05")
        self.assertEqual(format_cents(-250), "-2.50")


class TaxTest(unittest.TestCase):
    def test_total_with_tax_rounds_half_up(self):
        self.assertEqual(total_with_tax([(2, 500), (1, 250)], 10), 1375)
        self.assertEqual(total_with_tax([(1, 5)], 10), 6)


class SplitTest(unittest.TestCase):
    def test_even_split(self):
        self.assertEqual(split_evenly(900, 3), [300, 300, 300])

    def test_shares_add_up_to_the_total(self):
        shares = split_evenly(1000, 3)
        self.assertEqual(sum(shares), 1000)
        self.assertLessEqual(max(shares) - min(shares), 1)

    def test_rejects_zero_parts(self):
        with self.assertRaises(ValueError):
            split_evenly(100, 0)


if __name__ == "__main__":
    unittest.main()
