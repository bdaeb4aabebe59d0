"""Not the library: the demo (`python -m spark_jobs.demo`), the synthetic
click stream and its oracle (`clickstream`, shared by the demo, tests and
benchmarks), and the program that warms the JVM class archive (`warm_jvm`)."""
