from rlops.cli import main

main()
