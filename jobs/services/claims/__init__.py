"""The claim, queued → processing, made three ways behind one set of calls: `plain` for
an open queue (and by id), `turns` for a fair queue's clients and concurrency keys,
`limited` under the queue row's lock for a cap or a rate. jobs.queuecontrol.Gate picks
the way per queue; each returns the same Lease."""
