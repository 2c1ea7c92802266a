import unittest

from intervals import merge


class MergeTest(unittest.TestCase):
    def test_overlapping(self) -> None:
        self.assertEqual(merge([(1, 3), (2, 6), (8, 10)]), [(1, 6), (8, 10)])

    def test_unsorted_input(self) -> None:
        self.assertEqual(merge([(8, 10), (1, 3), (2, 6)]), [(1, 6), (8, 10)])

    def test_contained(self) -> None:
        self.assertEqual(merge([(1, 10), (2, 3)]), [(1, 10)])

    def test_touching(self) -> None:
        self.assertEqual(merge([(1, 2), (3, 4)]), [(1, 4)])

    def test_empty(self) -> None:
        self.assertEqual(merge([]), [])


if __name__ == "__main__":
    unittest.main()
