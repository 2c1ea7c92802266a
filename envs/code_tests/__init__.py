"""The `code-tests` environment: write a function, graded against hidden tests in the sandbox."""
