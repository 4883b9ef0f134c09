"""The test suite, a package so that `tests.support` imports the same way from the tests and the bench."""
