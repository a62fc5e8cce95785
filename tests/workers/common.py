# Transitional: lets the not-yet-converted worker scripts run (baseline check counts).
from checks import WORLD, Checks  # noqa: F401


class Failures(Checks):
    def finish(self):
        self.exit_report()

    @property
    def items(self):
        return self.failures
