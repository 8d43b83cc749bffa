"""`python -m elastic_mnist.compat`: run every check of torch's private API and print what it covered."""

from elastic_mnist.compat.private import main

main()
