"""The one error a scenario, a workload or a fault schedule is refused with, before any run starts."""


class ScenarioError(ValueError):
    """Bad input, named: the field (`fleet[2].tp`, `workload[0].trace`), the file and its row and column where
    the field is a file, the problem, and what is allowed instead.

    `row` is a CSV file's row as a spreadsheet numbers it: the header is row 1, the first request row 2.
    """

    def __init__(
        self,
        field: str,
        problem: str,
        allowed: str,
        *,
        source: str | None = None,
        row: int | None = None,
        column: str | None = None,
    ):
        self.field = field
        self.problem = problem
        self.allowed = allowed
        self.source = source
        self.row = row
        self.column = column
        where = field
        if source is not None:
            where += f" ({source})"
        if row is not None:
            where += f" row {row}"
        if column is not None:
            where += f", column {column}"
        super().__init__(f"{where}: {problem}; allowed: {allowed}")

    def within(self, prefix: str) -> "ScenarioError":
        """The same error, its field placed inside `prefix` (an arrival's `rate_rps` inside `workload[1]`)."""
        return ScenarioError(
            f"{prefix}.{self.field}", self.problem, self.allowed, source=self.source, row=self.row, column=self.column
        )
