from aiworks.cli import main

main()
