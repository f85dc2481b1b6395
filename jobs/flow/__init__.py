"""Flow control per key of work (issue 46): debounce, a rate per concurrency key (the
throttle a queue applies at the claim, the drop a submission asks for) and what a new
job does when its key is busy. docs/queue-controls.md gives the order they apply in."""
