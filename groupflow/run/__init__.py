"""A run from the user's side: the driver that opens, trains and ends it, the command line, the job config resolved, submitted jobs, live control and `groupflow eval`."""
