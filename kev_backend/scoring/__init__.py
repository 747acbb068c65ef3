"""Scoring on any device: the pointer head, the state bank's LRU, host copies and the fp32 reference scorer."""
