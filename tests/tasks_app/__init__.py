"""A sample app of Django Tasks run on jobservice (JOBS_TASK_MODULES=tests.tasks_app.tasks)."""
