"""The System One contract as Kev serves it: request validation and limits, rendering, answers, the token layout."""
