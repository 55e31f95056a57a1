# Its presence puts the repository root on sys.path (pytest's rootdir conftest), so tests
# and their spawned ranks can import `launch.model`.
