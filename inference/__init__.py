"""Engine logic with no Django imports: hardware catalog, planner, rules, parsers.

Everything here is plain Python so it can be unit-tested alone and reused by the
node agent, the simulator and the command line.
"""
