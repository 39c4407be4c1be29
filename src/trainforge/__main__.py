from trainforge.cli import main

main()
