"""The tests, laid out like the code they test: a folder per backend (reference/, cupy/,
numba/, torch/) with a file per stage (test_routing.py, test_align.py, ...), sandbox/ for the
layer and its tools; the checks of the project as a whole (README, notebooks) stay here.

Every folder is a package, so that files of the same name in different folders (the routing
tests of each backend) import as different modules (tests.cupy.test_routing, ...), and the
shared helpers import by their full name (`from tests.oracles import rel_err`). Nothing here
puts tests/ itself on sys.path: a folder named cupy, numba or torch there would shadow the
real package.
"""
