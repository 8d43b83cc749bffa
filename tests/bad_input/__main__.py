"""Print the bad-input table: `cd tests && python -m bad_input`."""

from bad_input import ROWS
from bad_input.frame import table

print(table(ROWS))
