"""A closed-loop ramp as a stage table: `locust -f locustfile.py,stages.py --stages 30:4,30:8,30:16` runs 4
users for 30 s, then 8, then 16. (Open-loop stages are rates, which the arrival schedule follows itself.)"""

from locust import LoadTestShape

from loadtest.scenarios.options import parse_pairs


class StagesShape(LoadTestShape):
    def tick(self):
        run_time, end = self.get_run_time(), 0.0
        for seconds, users in parse_pairs(self.runner.environment.parsed_options.stages, "--stages"):
            end += seconds
            if run_time < end:
                return int(users), max(1.0, users)  # all of a stage's users at once
        return None
