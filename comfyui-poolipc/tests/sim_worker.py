"""A poolipc worker without torch, for the tests on the real binding's simulated driver."""
import poolipc

for job in poolipc.Worker():
    with job:
        pass
